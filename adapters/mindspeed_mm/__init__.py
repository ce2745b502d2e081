"""MindSpeed-MM: its VLM model, data path, loss and train step with the plugin's features."""
