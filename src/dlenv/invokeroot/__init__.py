"""invoke's search root outside the image: a folder holding only a tasks.py that loads dlenv's tasks.

With `tasks: {search_root: <this folder>}` in ~/.invoke.yaml (`dlenv.invocation.set_up_invoke` writes it;
scripts/setup-cpu.sh calls that), `invoke VERB` loads dlenv's tasks from any folder, as /etc/invoke.yaml
does in the image. invoke puts the search root on sys.path, so nothing else lives here.
"""
