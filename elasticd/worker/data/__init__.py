"""What each step's global batch is made of: the elastic sampler, the data plan, and the DataLoader
integration."""
