"""Charts: the per-model Helm chart rendered from charts/nim-llm, its checks, packaging, a run in Docker, deploys."""
