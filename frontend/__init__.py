"""Static web UI served by the control plane (no build step)."""
