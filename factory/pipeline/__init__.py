"""The pipeline: typed stage results, the one runner every entry point uses, pipeline files, the demo."""
