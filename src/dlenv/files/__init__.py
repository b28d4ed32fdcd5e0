"""What is read from or written to disk that can be hostile or must be atomic: weights files (safetensors, .pth
through the pickle guard, ONNX), regular-file checks, atomic writes and the run-state format.
"""
