"""Release: SBOMs, pushes to an OCI registry and the catalog of what was published."""
