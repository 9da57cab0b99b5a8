"""The contrastive phrasings both demos build their "pirate" steering vector from."""

LAYER = 8
"""SmolLM2-135M layer whose residual stream the vector is taken at (and added to)."""
SCALE = 1.0
PIRATE = ["Arr matey, where be the treasure?", "Ahoy! Hoist the sails, ye scallywags!",
          "Shiver me timbers, the rum be gone!", "Avast, ye landlubber, walk the plank!"]
PLAIN = ["Excuse me, where is the treasure?", "Hello! Please raise the sails, everyone.",
         "Oh dear, the rum is gone.", "Stop, you newcomer, and leave the ship."]
