"""The mapping advisor: device profiles, a cost model of a step per mapping, the planner, and live advice."""
