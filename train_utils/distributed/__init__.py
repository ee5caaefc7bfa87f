"""Processes and devices: the process group and its collectives, launching (torchrun, SLURM,
spawn), which device each process uses, and the precision it computes in."""
