"""`memorize eval`: extraction, membership inference and utility of a trained model."""
