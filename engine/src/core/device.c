/* device.c: the device tables (core/device.h). */
#include "core/device.h"
#include <stdio.h>

static const eng_device_ops* g_devices[ENG_MAX_DEVICES];

void eng_device_register(int dev, const eng_device_ops* ops) {
  if (dev > ENG_CPU && dev < ENG_MAX_DEVICES && dev != ENG_META) g_devices[dev] = ops;
}

const eng_device_ops* eng_device_ops_of(int dev) {
  return dev >= 0 && dev < ENG_MAX_DEVICES ? g_devices[dev] : NULL;
}

int eng_device_check(int dev, const char* op) {
  if (dev == ENG_CPU || dev == ENG_META) return 0;
  const eng_device_ops* d = eng_device_ops_of(dev);
  if (!d) return eng_err("%s: invalid device code %d (0 = cpu, 1 = cuda, 2 = meta)", op, dev);
  if (!d->available()) return eng_err("%s: %s", op, d->unavailable_reason());
  return 0;
}

const char* eng_device_name(int dev) {
  static __thread char buf[16];
  if (dev == ENG_CPU) return "cpu";
  if (dev == ENG_META) return "meta";
  const eng_device_ops* d = eng_device_ops_of(dev);
  if (d) return d->name;
  snprintf(buf, sizeof buf, "device%d", dev);
  return buf;
}
