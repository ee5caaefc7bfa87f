"""Worker programs the tests start in processes of their own: ranks of 2-process gloo groups and
training runs with a kill point. Each is a module run as ``python -m tests.workers.<name>`` (by
``conftest.worker_cmd``, or by torchrun with ``-m``) and takes its parameters from the command
line or the environment; results go to files the test reads."""
