"""The planner's estimates of one layout: memory per GPU by pipeline stage (memory.py, with
activations.py) and the step time (time.py, from compute.py, comm.py, stage_time.py and
data_time.py). Pure functions of the spec, the model and the layout (toolkit.parallel); the
plan (toolkit.plan) runs them after its rules, the search (toolkit.search) over many layouts."""
