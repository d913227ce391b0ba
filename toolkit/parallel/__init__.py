"""The parallel layout: megatron-core's grid and every size derived from it (layout.py), and
where megatron places the layers (pipeline.py). Pure arithmetic on the floor above the models:
the planner, the emitters, the converters and the runtime read these facts here, and nothing
above derives them again."""
