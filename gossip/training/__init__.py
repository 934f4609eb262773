"""What a node trains and how: the node program, tasks, data, samplers, dataset loaders."""
