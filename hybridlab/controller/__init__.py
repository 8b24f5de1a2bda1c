"""The single controller: resource pools, device mappings, workers, dispatch and the WorkerSet."""
