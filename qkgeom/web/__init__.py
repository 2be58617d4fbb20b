"""The live page: the server, its HTML and the background refresh."""
