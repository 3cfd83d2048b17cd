"""Complete, small training scripts under Evenflow: an image pipeline, a text model with a
padding collate and a per-token loss, and a streaming dataset. See ``docs/guide/porting.md``."""
