"""Datasets and input: safe unpacking (`unpack`), layout detection and the dataset report (`folder`), the
built-in demo dataset (`demo`), every input decision (`plan`), the builder of what a plan says (`pipeline`)
and the pieces it composes: decoding (`decode`, `hwdecode`), the CPU path (`loaders`), the device path
(`fastpath`, `gpu_aug`) over its sources of batches (`sources`, `cache`), the one bad-image rule
(`badimages`), the resumable sampler (`sampler`) and synthetic batches (`synthetic`)."""
