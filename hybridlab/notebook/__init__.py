"""The notebook control plane: ipywidgets editors and controls over a running RLSession.

    rl.mapping_editor()   # pools and roles as a table, a drawing of the devices, Validate / Apply
    rl.dataflow_editor()  # stages on and off, algorithms from the registries, live hyperparameters
    rl.controls()         # Start, Pause, Resume, Step, Stop with progress and the latest metrics
    rl.inspect(result)    # a step's Batch as a sortable table, after any stage

Every widget calls the session's plain-Python methods (``remap``, ``update``, ``start_background``,
``pause``, ``run_stage``...); nothing here changes a session in a way code could not.
"""
from hybridlab.notebook.controls import Controls
from hybridlab.notebook.dataflow_editor import DataflowEditor
from hybridlab.notebook.batch_table import BatchTable
from hybridlab.notebook.mapping_editor import MappingEditor

__all__ = ["BatchTable", "Controls", "DataflowEditor", "MappingEditor"]
