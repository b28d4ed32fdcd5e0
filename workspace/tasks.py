"""`invoke VERB` in this folder: dlenv's verbs as invoke tasks (`invoke --list`, `invoke train --amp`).

In the dlenv image /etc/invoke.yaml already finds them (this file is then read only by `invoke -r .`,
and gives the same verbs); outside it, in a copy of this folder, invoke finds this file. Add tasks of
your own below: `ns.add_task(my_task)`.
"""

from dlenv.tasks import ns  # noqa: F401 (the collection invoke looks for)
