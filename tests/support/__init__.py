"""The tests' harness: worker pools, matrix rows, golden values, fault injectors, servers, shared builders."""
