"""Small C++ kernels for the CPU, compiled with g++ on first use and called through ctypes."""
