"""Memory strategies. Each is a small class or function with a typed config; ``memopt.compose``
applies the selected ones in one fixed order."""
