"""Datasets: the indexed .bin/.idx format, GPT sample indices, blending."""
