"""The callbacks kmirror runs around the steps: its own (public in `kmirror.callbacks`), Keras'
and Ray Train's made to write once, and the watch that turns `SIGTERM` into a backup and an exit."""
