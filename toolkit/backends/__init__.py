"""What megatron-core and DeepSpeed themselves require, on a floor under the planner, the
emitters and the converters, which all read it: megatron's model fields, rope and argument
checks, padded vocabulary; DeepSpeed's config keys and bucket sizes."""
