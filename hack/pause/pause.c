/* The pod sandbox process: holds the pod's namespaces and exits on SIGINT/SIGTERM. */
#include <signal.h>
#include <unistd.h>
static void quit(int s) { (void)s; _exit(0); }
int main(void) { signal(SIGINT, quit); signal(SIGTERM, quit); for (;;) pause(); }
