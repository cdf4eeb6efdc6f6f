"""Routing traces: the project's own versioned format, importers and the engine's recorder."""
