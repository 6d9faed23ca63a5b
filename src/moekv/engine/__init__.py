"""The engine: schedule -> run the model -> sample -> postprocess, one step at a time."""
