"""The plans domain: the rules of requesting a plan and of reporting on one, shared by the API and the jobs."""
