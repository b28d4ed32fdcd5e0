"""Where the processes run: the device and cores of each process, launching with torchrun, and DDP.
"""
