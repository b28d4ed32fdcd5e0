"""What one training step is made of, for the trainer, bench-memory and your own loop: the precision object
(one AMP path), the optimizer, the step, GPU memory monitoring, and the searches for the batch and the
checkpointing that fit.
"""
