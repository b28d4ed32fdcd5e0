"""The bench commands, each over the trainer's own step (dlenv.engine.step.train_step).

    memory.py         `dlenv bench-memory`: FP32 / AMP / checkpointing / both, each in a fresh worker process
    memory_worker.py  the measuring inside one such process
    data.py           `dlenv bench-data`: the input pipeline's speed against the model's, and the verdict

Measured numbers go to docs/benchmarks.md (with the machine they came from), never into the code.
"""
