"""Model weights as signed OCI artifacts: push (CNCF ModelPack), sign and verify (OpenSSF model-signing)."""
