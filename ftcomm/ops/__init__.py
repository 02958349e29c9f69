"""Operating a run: the launcher and the command line, metrics, the network check,
stragglers and the demo."""
