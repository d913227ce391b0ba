"""The planner's search (``toolkit plan --auto``): every layout of a job, the spine's rules
judged on partly chosen layouts (partial.py) so that one error rejects a whole family, the walk
over the grids with the estimates of toolkit.estimate (walk.py), the ranking (search.py:
``search``), and the published runs compared with both (published.py).
Nothing is imported here: ``import toolkit.search.choices`` does not load the walk (numpy)."""
