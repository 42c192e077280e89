package org.apache.spark.shuffle.hybridray;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.ray.api.exception.RayTimeoutException;
import java.io.IOException;
import java.nio.file.Paths;
import java.util.Locale;
import org.junit.jupiter.api.Test;

class RaySegmentSinkTest {
  @Test
  void aCommitThatTimedOutIsToldApartFromOneTheMasterRefused() {
    // A timed-out commit may still be applied by the master (its abort then frees the
    // batch): the sink must not give the batch's grants back as well.
    assertTrue(RaySegmentSink.timedOut(new IOException("hybrid_ray call spark_commit failed",
        new RayTimeoutException("Get timed out: some object(s) not ready."))));
    assertFalse(RaySegmentSink.timedOut(new IOException("hybrid_ray call spark_commit failed",
        new RuntimeException("ShuffleStateError: attempt 3 of map 0 was aborted"))));
    assertFalse(RaySegmentSink.timedOut(new IOException("no cause")));
  }

  @Test
  void segmentFileNamesUseAsciiDigitsWhateverTheExecutorsLocale() {
    // An executor started with LANG=ar_EG (or fa, mr, bn, ...) has a default locale whose
    // digits are not ASCII: String.format("%05d") then named the directory "sub-٠٠٠١٢". A
    // tier manager refuses to serve (and to delete) a file that is not
    // .../hybrid_ray/<shuffle>/sub-<digits>/<[A-Za-z0-9_.-]>, so every read of it from
    // another node failed as a lost map output, again after each recomputation.
    Locale before = Locale.getDefault();
    try {
      for (String tag : new String[] {"ar-EG", "fa", "mr", "th-TH-u-nu-thai"}) {
        Locale.setDefault(Locale.forLanguageTag(tag));
        assertEquals(Paths.get("/spill", "hybrid_ray", "spark-app-1-0", "sub-00012",
                "m000003-a12345-s000007.seg"),
            RaySegmentSink.segmentPath("/spill", "spark-app-1-0", 3, 12345L, 12, 7), tag);
      }
    } finally {
      Locale.setDefault(before);
    }
  }

  @Test
  void aSegmentFileIsOnlyNamedBelowAnAbsoluteSpillDirAndItsShufflesDirectory() {
    // The grant's target comes from a tier manager, the key with the task's handle: a
    // relative target was written below the executor's working directory, a key with a
    // separator or '..' outside the shuffle's directory, where no release removes it.
    String key = "spark-app-1-0";
    for (String target : new String[] {"", "spill", "relative/spill", "/spill/../etc"}) {
      assertThrows(IllegalArgumentException.class,
          () -> RaySegmentSink.segmentPath(target, key, 3, 12345L, 12, 7), target);
    }
    for (String bad : new String[] {"..", "../../etc", "a/b", "/abs", ".hidden", ""}) {
      assertThrows(IllegalArgumentException.class,
          () -> RaySegmentSink.segmentPath("/spill", bad, 3, 12345L, 12, 7), bad);
    }
    assertThrows(IllegalArgumentException.class,
        () -> RaySegmentSink.segmentPath("/spill", key, 3, 12345L, -1, 7));
    assertThrows(IllegalArgumentException.class,
        () -> RaySegmentSink.segmentPath("/spill", key, 3, -5L, 1, 7));
    assertEquals(Paths.get("/spill/hybrid_ray/spark-app-1-0/sub-00012/m000003-a12345-s000007.seg"),
        RaySegmentSink.segmentPath("/spill", key, 3, 12345L, 12, 7));
  }
}
