"""The process: the CLI, the workers supervisor, the demo, generated docs."""
