"""Operating a run: the launcher and the command line, metrics, the network check,
stragglers, the demo, local child processes and network interfaces."""
