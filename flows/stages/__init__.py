"""The pipeline's stages, one typed Prefect task each (see DESIGN.md's stage table)."""
