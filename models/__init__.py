"""The Darknet model built from a cfg file, its layers, loss and weight formats."""
