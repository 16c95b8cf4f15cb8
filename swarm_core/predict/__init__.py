"""``swarm predict``: a run's step time, each stage's utilisation and the link that bounds it,
from the machine's measured compute, the schedule, the project's own byte plans and the
network profile's links. The model is ``step``'s docstring; torch is needed only to measure
(``calibrate``) and to ask a sync algorithm its plan (``sync_plan``)."""
