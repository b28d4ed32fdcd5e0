"""Every option of every command declared once: the declarations, their values and bounds, YAML files, help
text and the path checks made before PyTorch loads. No torch here.
"""
