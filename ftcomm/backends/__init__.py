"""Communicator backends: a communicator per agreed view with abortable collectives."""
