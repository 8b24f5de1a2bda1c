"""Agentic rollouts: multi-turn trajectories with tools, recorded token by token.

``trajectory`` holds a trajectory's tokens by source; ``conversation`` turns chat messages into
those tokens exactly; ``tools`` makes plain functions callable by the model; ``engine`` drives
the in-process vLLM engine from an event loop; ``tool_loop`` is one trajectory's model client
and the built-in agent that calls tools; ``endpoint`` serves OpenAI-SDK agents; ``env_loop``
runs gym-style text environments; ``rollout`` runs many trajectories at once and lays them out
for the trainer; ``traces`` encodes tool-use conversations for the warm start.
"""
