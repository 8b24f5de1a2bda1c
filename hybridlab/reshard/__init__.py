"""Resharding: move weights from the training layout (TP x PP x DP) to the rollout layout."""
