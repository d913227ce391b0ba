"""Mixtral (MoE): registered with issue 4."""
