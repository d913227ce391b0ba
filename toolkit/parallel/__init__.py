"""The parallel layout and what it keeps where: megatron-core's grid and every size derived from
it (layout.py), where megatron places the layers (pipeline.py), which model states each ZeRO stage
partitions (zero.py) and the precision's element (precision.py). Pure arithmetic on the floor
above the models: the planner, the emitters, the converters and the runtime read these facts
here, and nothing above derives them again."""
