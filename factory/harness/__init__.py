"""The test harness: conformance, accuracy, performance and metrics checks of any OpenAI-compatible URL."""
