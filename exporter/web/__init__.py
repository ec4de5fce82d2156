"""HTTP: the routes (``routes``) and the server they run in (``server``)."""
