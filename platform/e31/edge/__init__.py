"""The edge to the outside: settings, the wiring that builds every shared object, the Celery
app, the bundle store, artifacts, S3 and Flower's guard."""
