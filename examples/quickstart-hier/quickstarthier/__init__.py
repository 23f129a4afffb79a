"""quickstarthier: a Flower / PyTorch app, trained hierarchically with fedhier."""
