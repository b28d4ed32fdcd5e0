"""Datasets and input: safe unpacking (`unpack`), layout detection and the dataset report (`folder`), the
built-in demo dataset (`demo`), every input decision (`pipeline`) and the pieces it composes: decoding
(`decode`), the CPU path (`loaders`), the device path (`fastpath`, `gpu_aug`, `cache`), the
resumable sampler (`sampler`) and synthetic batches (`synthetic`)."""
