"""The data plane as the coordinator sees it: outputs, staged inputs, datasets,
checkpoint copies, transfers and task logs."""
