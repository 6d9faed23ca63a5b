"""Fused MoE experts (decode: few tokens; align + grouped: many), their tuned configs, and the
expert-parallel exchange's routing step."""
